"""moe.output_hidden's one assumption about Megatron-Core, checked against the installed version: clearing
GPTModel.post_process around forward returns the decoder's output (after the final norm) instead of the
logits, and changes nothing else in forward. The values and gradients of the hidden-state path against the
logits path are checked end to end in tests/test_policy_hidden_logprobs.py (TP=1, TP=2, PP=2).
"""

from __future__ import annotations

import inspect
import re


def test_gpt_model_reads_post_process_only_to_return_the_hidden_states():
    from megatron.core.models.gpt.gpt_model import GPTModel

    postprocess = inspect.getsource(GPTModel._postprocess)
    assert re.search(r"if not self\.post_process:\s*\n\s*return hidden_states\b", postprocess), \
        "GPTModel._postprocess no longer returns the hidden states when post_process is False"
    # before that return only MTP runs (refused by moe.output_hidden), after it the output layer
    head = postprocess[:postprocess.index("if not self.post_process:")]
    assert "self.output_layer(" not in head
    assert postprocess.count("self.post_process") == 1
    forward = inspect.getsource(GPTModel.forward)
    assert "self.post_process" not in forward and "self._postprocess(" in forward
    preprocess = inspect.getsource(GPTModel._preprocess)
    assert "self.post_process" not in preprocess
    # the tied output weight is looked up outside the switched call (output_weight), where the flag is True
    assert "self.post_process" in inspect.getsource(GPTModel.shared_embedding_or_output_weight)


def test_output_hidden_never_imports_megagspo():
    import moe.output_hidden as module

    source = inspect.getsource(module)
    assert not re.search(r"^\s*(from|import)\s+megagspo", source, re.M)
