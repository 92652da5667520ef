"""What the engine's Trio front raises to a handler, besides a request's own SamplingParamError
(a 400 naming its field) and LoRAError (which carries its status)."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later (a 429)."""


class EngineUnavailableError(RuntimeError):
    """The engine cannot take or finish requests: it died, the server is shutting down, or it
    sleeps (a 503)."""


class WeightsError(ValueError):
    """A sleep, wake-up or weight update that cannot be done (a 400): the message says why, and
    the weights that served before still serve."""
