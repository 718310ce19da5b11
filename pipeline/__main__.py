"""``python -m pipeline --config CONFIG [--input GLOB] [--output PREFIX] [Beam flags]``."""
import sys

from pipeline.run import main

sys.exit(main())
