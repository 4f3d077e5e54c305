"""``python -m radixlm``: the command-line interface."""

from radixlm.runtime.entrypoints.cli.main import main

if __name__ == "__main__":
    main()
