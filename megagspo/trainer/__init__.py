"""Cold-start SFT and GSPO / GSPO-token / GRPO training on Megatron-Core with an embedded rollout engine.

The package imports nothing itself, so that the checks a dry run shares with the trainer (`layout`,
`preflight`) load without the model code: the run is `megagspo.trainer.trainer.Trainer`."""
