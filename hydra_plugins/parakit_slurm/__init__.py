"""parakit's Slurm launcher for Hydra (`hydra/launcher=slurm`, toolkit/conf/hydra/launcher/slurm.yaml):
hydra-submitit-launcher's `submitit_slurm`, with each point asking Slurm for what its world size
needs, recorded points not submitted again, progress printed here as points finish, and a point
whose Slurm job dies recorded as failed. Hydra instantiates launchers only from the hydra_plugins
package (and imports every module there at start-up: keep this one light); the work is in
toolkit.report.sweep_slurm."""

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # not installed: `parakit sweep` names the package when Slurm is asked for
    SlurmLauncher = None

if SlurmLauncher is not None:

    class ParakitSlurmLauncher(SlurmLauncher):
        def launch(self, job_overrides, initial_job_idx):
            from toolkit.report.sweep_slurm import launch

            return launch(self, job_overrides, initial_job_idx)
