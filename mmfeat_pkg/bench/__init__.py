"""``mmfeat bench``: the handoff measured against the alternatives, in one invocation."""
