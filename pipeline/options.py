"""newsvec's own pipeline options, beside Beam's (runner, project, ...).

These are also the user-facing parameters of the Flex Template
(configs/flex-template-metadata.json); tests/end_to_end/test_dataflow.py fails if the two
drift apart.
"""
from apache_beam.options.pipeline_options import PipelineOptions


class NewsvecOptions(PipelineOptions):
    @classmethod
    def _add_argparse_args(cls, parser):
        parser.add_argument("--config", default=None,
                            help="YAML config file, a local path or gs:// "
                                 "(default: configs/local.yaml)")
        parser.add_argument("--input", default=None,
                            help="JSON Lines glob, local or gs://; overrides the config's input")
        parser.add_argument("--output", default=None,
                            help="Output prefix, local or gs://; overrides the config's output")
        parser.add_argument("--subscription", default=None,
                            help="Pub/Sub subscription (projects/P/subscriptions/S): stream from "
                                 "it; overrides the config's streaming.subscription")
        parser.add_argument("--input_date", default=None,
                            help="The date that fills {date} (or {date:STRFTIME}) in the input and "
                                 "output: YYYY-MM-DD, 'today' or 'yesterday' (UTC at launch). "
                                 "Default: yesterday, the last complete day. Only for batch "
                                 "configs that hold {date}")
