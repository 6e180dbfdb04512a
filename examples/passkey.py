"""The passkey format, kept in the package (hf_dilated.eval.passkey) so that `hf-dilated eval`
and the training examples use one definition; re-exported here for the examples."""
from hf_dilated.eval.passkey import (  # noqa: F401
    BRACKETS, FILLER, IGNORE_INDEX, INTRO, KEY_COPIES, KEY_DIGITS, KEY_SENTENCE, QUESTION, RECALL_END, min_length,
    multikey_length, multikey_sample, passkey_sample)
