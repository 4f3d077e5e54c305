"""Speculative decoding: proposers of draft tokens, the gate that decides who speculates, and the
speculator that feeds their drafts to the decoder's verification."""
