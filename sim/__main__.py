"""`python -m sim [flags]`: same as `datagen sim [flags]`."""

from sim.server import main

raise SystemExit(main())
