"""The HTTP edge of `sparserl serve`: SGLang's native routes over any `RolloutEngine`.

`server` (the FastAPI app), `worker` (the scheduler thread between the event loop and the engine),
`wire` (request/response shapes shared with the client), `errors`, `timeouts`, `cli`.
"""
