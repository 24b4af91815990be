import sys

from quarl.cli.main import main

sys.exit(main())
