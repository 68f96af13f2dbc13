"""The one exception type the CLI turns into a single line on stderr."""


class BlockscopeError(Exception):
    """Bad input or an unusable environment, explained in one sentence for the user."""
