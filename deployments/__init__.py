"""Ray Serve deployments: HTTP ingress and engine replicas (issue 4)."""
