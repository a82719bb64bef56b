from specd.cli import main

raise SystemExit(main())
