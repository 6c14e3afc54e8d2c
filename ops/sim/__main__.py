"""`python -m ops.sim [flags]`: same as `datagen sim [flags]`."""

from ops.sim.server import main

raise SystemExit(main())
