"""hyla: an open stack for hybrid linear-attention language models."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import hyla.ops` stays light (no engine / model imports).
    if name in ("LLM", "SamplingParams", "LLMEngine", "EngineConfig"):
        import hyla.engine

        return getattr(hyla.engine, name)
    raise AttributeError(f"module 'hyla' has no attribute {name!r}")
