"""`python -m distdiag` is the `distdiag` command."""

from distdiag.cli import main

if __name__ == "__main__":
    main()
