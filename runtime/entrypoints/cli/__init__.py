"""The command lines: `radixlm serve|generate|router` and `explain-cache`."""
