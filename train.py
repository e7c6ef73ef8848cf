"""lit-ppo's entry point: `python train.py [overrides]` (Hydra; configs in conf/)."""

import logging
import sys

import hydra
from omegaconf import DictConfig

from lit_ppo.errors import DynamicSamplingShortfallError, NonFiniteUpdatesError, StepAccountingError
from lit_ppo.plan import ConfigError
from lit_ppo.prompts import DataError
from lit_ppo.rewards import RewardError


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from lit_ppo.run import main as run

    try:
        run(cfg)
    except (ConfigError, DataError, RewardError, NonFiniteUpdatesError, StepAccountingError,
            DynamicSamplingShortfallError) as error:
        # A mistake the user can fix: one line, no traceback.
        logging.getLogger("lit_ppo").error("%s: %s", type(error).__name__, error)
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
