"""Bad input: the target raises while it is imported."""

raise RuntimeError("this target is broken on purpose")
