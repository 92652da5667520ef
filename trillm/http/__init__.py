"""The Quart-Trio app: OpenAI-compatible and native routes, protocol models, SSE, auth, metrics."""
