"""newsvec's own pipeline options, beside Beam's (runner, project, ...)."""
from apache_beam.options.pipeline_options import PipelineOptions


class NewsvecOptions(PipelineOptions):
    @classmethod
    def _add_argparse_args(cls, parser):
        parser.add_argument("--config", default=None,
                            help="YAML config file (default: configs/local.yaml)")
        parser.add_argument("--input", default=None,
                            help="JSON Lines glob, local or gs://; overrides the config's input")
        parser.add_argument("--output", default=None,
                            help="Output prefix, local or gs://; overrides the config's output")
        parser.add_argument("--subscription", default=None,
                            help="Pub/Sub subscription (projects/P/subscriptions/S): stream from it; "
                                 "overrides the config's streaming.subscription")
