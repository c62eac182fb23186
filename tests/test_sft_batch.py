"""The cold-start SFT feeds the model its SequenceBatch's one-sequence-per-row view (model_input with aux_len):
tensor for tensor the padded batch SFT built before SequenceBatch (build_sequences + ModelInput.padded: the router
aux loss sees every position below the batch's natural width), so that the cold start's numbers do not move."""

import torch

from megagspo.policy.megatron_policy import ModelInput, build_sequences
from megagspo.rl.batch import SequenceBatch

PAD, EOS = 0, 2


def test_sfts_model_view_is_the_padded_batch_sft_built_before():
    prompts = [[5, 6, 7], [5, 6], [5, 6, 7, 8, 9]]            # prompts of different lengths
    answers = [[9, EOS], [9, 9, 4, 3, EOS], [3, EOS]]
    width = max(map(len, answers))
    resp, mask = torch.full((3, width), PAD), torch.zeros((3, width), dtype=torch.bool)
    for i, a in enumerate(answers):
        resp[i, :len(a)], mask[i, :len(a)] = torch.tensor(a), True
    natural = max(map(len, prompts)) + width - 1
    for row_len in (natural, natural + 3):                     # + 3: a TP alignment tail
        inp, tgt, _, _ = build_sequences(prompts, resp, mask, PAD, length=row_len)
        seqs = SequenceBatch.from_demonstrations(prompts, answers, PAD, row_len)
        for rows in ([0, 1, 2], [1], [2, 0]):                  # micro-batches are sub-batches
            got = seqs.select(rows).model_input(False, None, aux_len=natural).model
            want = ModelInput.padded(inp[rows], tgt[rows], natural)
            assert torch.equal(got.input_ids_BS, want.input_ids_BS) and torch.equal(got.targets_BS, want.targets_BS)
            if row_len == natural:
                assert got.padding_mask_BS is None and want.padding_mask_BS is None
            else:                                              # only the alignment tail is padding
                assert torch.equal(got.padding_mask_BS, want.padding_mask_BS) and got.padding_mask_BS.any()
        # the RL step's rows of the same sequences leave everything past each sequence out of the aux loss
        rl_rows = seqs.model_input(False, None).model
        assert rl_rows.padding_mask_BS.sum() == 3 * row_len - sum(seqs.lengths)
