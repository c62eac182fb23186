"""The RL step and its data: rollout sources, the update batch's micro-batches, DP balancing, the step itself
(`megagspo.rl.step.RLStep`). It never imports `megagspo.trainer`: the trainer builds it from explicit parts."""
