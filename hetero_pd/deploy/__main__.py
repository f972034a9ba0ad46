"""`python -m hetero_pd.deploy {validate,plan,render} ...`."""

from __future__ import annotations

import sys

from hetero_pd.deploy.cli import main

sys.exit(main())
