from stallfree.cli import main

raise SystemExit(main())
