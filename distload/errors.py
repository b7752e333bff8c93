"""distload's errors: one base class, a few subclasses (DESIGN §4.5).

Every message names the tensor or file, the rule, the numbers and the fix, so a user can act on it
without reading our code. Everything a user can cause is raised as one of these, never an assert.
"""


class DistloadError(Exception):
    """Base of every error distload raises on purpose."""


class CheckpointError(DistloadError):
    """A checkpoint file, header, index or config is malformed, unsafe or inconsistent."""


class RuleError(DistloadError):
    """A rules file (configs/*.toml) is malformed, or no rules file fits the checkpoint."""


class OptionError(DistloadError):
    """A command-line option (or its Python keyword) has a value distload cannot use."""


class PlanError(DistloadError):
    """The checkpoint cannot be laid out on this topology (divisibility, names, shapes, dtypes)."""


class RankFailure(DistloadError):
    """Another rank failed; raised on every rank so that all of them exit together."""

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})
