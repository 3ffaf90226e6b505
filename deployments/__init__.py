"""Ray Serve deployments: the engine replicas, which serve the HTTP routes, and the app that binds them."""
