from qwire.cli import main

raise SystemExit(main())
