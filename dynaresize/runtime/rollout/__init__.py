"""Rollout engines behind one interface (`base`): the portable torch engine and vLLM."""
