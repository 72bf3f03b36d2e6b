"""The tokenizer's name in stored progress: equal for tokenizers that map text to the same ids."""

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from worker.prompt_tokens import tokenizer_fingerprint


def word_tokenizer(vocab: dict[str, int]) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


VOCAB = {"[UNK]": 0, "amount": 1, "merchant": 2, "grocery": 3}


def test_the_same_vocabulary_is_named_alike_however_the_caller_truncates_or_pads():
    a, b = word_tokenizer(VOCAB), word_tokenizer(dict(reversed(list(VOCAB.items()))))
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    b.backend_tokenizer.enable_truncation(8)
    b.backend_tokenizer.enable_padding(length=8)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)


def test_other_ids_for_the_same_text_are_named_apart():
    base = tokenizer_fingerprint(word_tokenizer(VOCAB))
    swapped = {**VOCAB, "merchant": 3, "grocery": 2}  # the same words, other ids
    assert tokenizer_fingerprint(word_tokenizer(swapped)) != base
    added = word_tokenizer(VOCAB)
    added.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    assert tokenizer_fingerprint(added) != base
