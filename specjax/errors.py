"""User-facing errors.

A `SpecJaxError` is a mistake in what the user gave us (a path, a flag, a file's contents); the CLI
prints its message and exits with code 2, without a traceback. Anything else is a bug and keeps its
traceback.
"""


class SpecJaxError(Exception):
    """A user error: the message names the offending file, field or value."""


class ModelFormatError(SpecJaxError):
    """A model file or directory is missing, unreadable, or of an unsupported kind."""


class ConfigError(SpecJaxError):
    """A configuration value or flag is out of range or inconsistent with another."""
