"""The one exception of the config package."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used. ``problems`` lists every violation, one line each."""

    def __init__(self, problems: str | list[str], header: str = "invalid config"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = f"{header}: {self.problems[0]}"
        else:
            msg = f"{header} ({len(self.problems)} problems):\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)
