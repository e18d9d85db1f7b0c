import sys

from effattn.cli import main

sys.exit(main())
