"""The error a broken tensor-parallel group raises (a worker died, a collective failed or timed
out): the engine cannot continue, so LLMEngine lets it through instead of failing one request."""


class TensorParallelError(RuntimeError):
    pass
