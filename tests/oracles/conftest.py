from tests.oracles.kimi_checkpoint import kimi_checkpoint  # noqa: F401  (session fixture)
