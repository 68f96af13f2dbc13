"""The one exception type the CLI turns into a single line on stderr."""


class BlockscopeError(Exception):
    """Bad input or an unusable environment, explained in one sentence for the user."""


class ModelUnavailable(BlockscopeError):
    """The model is neither local nor cached, and the hub cannot be reached: not a broken
    checkpoint. `reproduce` goes on without it; everything else stops."""
