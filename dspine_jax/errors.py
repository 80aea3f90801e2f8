"""Errors a user can act on. Each message names the file, field or value at fault."""


class DSpineError(Exception):
    """Base class: anything the CLI reports as a one-line error instead of a traceback."""


class ConfigError(DSpineError, ValueError):
    """A model or run configuration is invalid or unsupported."""


class CheckpointError(DSpineError):
    """A checkpoint is missing, corrupt, or disagrees with its config."""


class InputError(DSpineError, ValueError):
    """A request is malformed: bad sampling parameters, prompt past the context, ..."""
