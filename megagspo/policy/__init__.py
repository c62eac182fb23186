"""The model side of a run: the Megatron policy (`megatron_policy.MegatronPolicy`), the frozen KL reference, weight
initialisation, the link to the rollout engine. It imports neither `megagspo.rl` nor `megagspo.trainer`."""
