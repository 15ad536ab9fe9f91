"""A plain Horovod + Keras (tf.keras = Keras 2) training script: nothing in it knows about Blink.

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/keras_train.py
    blinkrun   -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/keras_train.py

Horovod 0.28 needs ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported
(``blinkrun`` sets it when unset; with ``horovodrun`` set it yourself).  The
script uses Horovod's ``DistributedOptimizer`` and its callbacks
(``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateWarmupCallback``); under Blink, add
``hvd.callbacks.BlinkCommunicationCallback()`` to see Blink's communication
per epoch (``--blink-callback``).  ``--save FILE`` writes rank 0's weights (``.npz``).
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15, help="optimizer steps in all (epochs x steps per epoch)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--save", default="")
    ap.add_argument("--blink-callback", action="store_true")
    args = ap.parse_args()

    hvd.init()
    tf.keras.utils.set_random_seed(1234 + hvd.rank())  # different initial weights: the callback broadcasts them

    per_epoch = max(1, args.steps // args.epochs)
    rng = np.random.default_rng(42 + hvd.rank())
    x = rng.standard_normal((per_epoch * args.batch, 32)).astype(np.float32)
    y = rng.integers(0, 10, per_epoch * args.batch)

    model = tf.keras.Sequential([tf.keras.layers.Dense(128, activation="relu", input_shape=(32,)),
                                 tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=0.01 * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=1,
                                                 momentum_correction=False, verbose=0),
    ]
    if args.blink_callback and hasattr(hvd.callbacks, "BlinkCommunicationCallback"):
        callbacks.append(hvd.callbacks.BlinkCommunicationCallback())
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    if args.save and hvd.rank() == 0:
        np.savez(args.save, **{f"w{i}": w for i, w in enumerate(model.get_weights())})


if __name__ == "__main__":
    main()
