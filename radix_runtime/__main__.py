import sys

from radix_runtime.cli import main

sys.exit(main())
