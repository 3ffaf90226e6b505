"""The HTTP routes of every API, built on FastAPI, and how they read a request's choices and answer errors. The
routes take the engine through the EngineClient protocol (routes/engine_client.py), so they run against a real
engine in one process as well as inside a Serve replica. Imports api/ and gate/."""
