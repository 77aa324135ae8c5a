from gspo_kernels.cli import main

raise SystemExit(main())
