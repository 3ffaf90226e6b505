"""The HTTP routes of every API, built on FastAPI (routes.py), how they read a request's choices and stream them
(choice_streams.py), and how they answer errors (error_handlers.py). The engine replica serves them through
@serve.ingress. Imports api/ and gate/."""
