"""Test-only rewards with a known optimum, imported by Ray reward workers by module name."""


def starts_with_space(text: str, target: str) -> float:
    """1 when the response's first character is a space: about 1 token in 5 of the tiny judge's
    byte-level vocabulary starts with one, so a random judge earns ~0.2 and an optimal one 1."""
    return 1.0 if text.startswith(" ") else 0.0


def broken(text: str, target: str) -> float:
    """A reward that fails when it is first called (at step 1, after set-up): a trial made to fail."""
    raise RuntimeError("this reward is made to fail")
