"""Which replica serves a request: the routing policy (adapter residence, cached prefix, load band), Serve's
request router, HAProxy's ingress router, a replica's view of its peers, direct ingress and the HAProxy launcher.
Imports nothing else of deployments/ and no torch: it runs in Serve's proxy and in every handle's process."""
