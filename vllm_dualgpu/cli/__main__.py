"""``python -m vllm_dualgpu.cli`` = the ``vllm-dualgpu`` command."""

from vllm_dualgpu.cli import main

raise SystemExit(main())
