"""``python -m radixlm``: the command-line interface."""

from radixlm.runtime.cli import main

if __name__ == "__main__":
    main()
