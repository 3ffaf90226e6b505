"""OTLP trace receivers on the loopback, real servers of both OTLP transports, for the tracing tests: an HTTP
one (POST /v1/traces, protobuf bodies) and a gRPC TraceService."""

from __future__ import annotations

import contextlib
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: keeps each POST's path, content type and body on its server."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def http_receiver():
    """Yields the endpoint and the list of (path, content type, body) of what it was sent."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    server.posts = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", server.posts
    finally:
        server.shutdown()
        server.server_close()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.requests = []

    def Export(self, request, context):  # the gRPC service's method
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def grpc_receiver(host: str = "127.0.0.1"):
    """Yields the endpoint and the list of ExportTraceServiceRequests it was sent."""
    service, server = _TraceService(), grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    try:
        yield f"http://{host}:{port}", service.requests
    finally:
        server.stop(grace=None)


def exported_names(requests_: list[trace_service_pb2.ExportTraceServiceRequest]) -> tuple[set[str], set[str]]:
    """The span names and the service names of what a receiver got."""
    spans, services = set(), set()
    for request in requests_:
        for resource_spans in request.resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
            spans |= {s.name for scope in resource_spans.scope_spans for s in scope.spans}
    return spans, services
