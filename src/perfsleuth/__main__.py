"""``python -m perfsleuth`` runs the command line."""

from perfsleuth.cli.entry import main

if __name__ == "__main__":
    main()
