from fastsync.cli import main

raise SystemExit(main())
