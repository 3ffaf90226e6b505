"""The engine's refusals, apart from the engine: the serving side catches them and names their retry delay in its
HTTP answers, and imports this module without torch (deployments/app.py is imported by Serve's build step)."""

OVERLOADED_RETRY_AFTER_S = 1.0


class EngineDeadError(RuntimeError):
    pass


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (max_waiting_requests): the caller should retry later."""

    def __init__(self, waiting: int, retry_after_s: float):
        super().__init__(f"the engine is overloaded: {waiting} requests are already waiting; retry later")
        self.retry_after_s = retry_after_s
