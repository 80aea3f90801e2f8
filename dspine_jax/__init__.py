"""DSpine-JAX: speculative decoding with DSpine and DFlash drafters in JAX/Flax."""

__version__ = "0.1.0"
