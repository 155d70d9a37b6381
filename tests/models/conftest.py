from tests.oracles.kimi_checkpoint import kimi_checkpoint  # noqa: F401  (session fixture)
from tests.oracles.qwen3_next_checkpoint import qwen3_next_checkpoint  # noqa: F401  (session fixture)
