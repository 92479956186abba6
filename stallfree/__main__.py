from stallfree.cli import main

if __name__ == "__main__":  # guard: spawned worker processes re-import __main__
    raise SystemExit(main())
