# fmt: off
# The seed guide's complete torchrun script (seed_torchrun.py) run by ray_ddp: the diff
# is in docs/own-loop.md. YourDataset and YourModel: the built-in dataset and small_cnn.
import torch.nn as nn
import torch.optim as optim

import ray_ddp
from ray_ddp.image_classification.models import build_model
from ray_ddp.image_classification.synthetic import make_synthetic


def main(run):
    # 1. parse the arguments
    args = run.config  # jobs/train.py's flags by section: args.optim.lr is --lr, ...
    # 2. initialise the distributed environment
    # 3. fix the random seed (optional, for reproducibility)
    # 4. prepare the data
    train_dataset, val_dataset = make_synthetic(args.optim.seed, args.data.train_samples, args.data.val_samples)  # noqa: E501
    # 5. build the model
    model = run.setup(build_model('small_cnn', (3, 16, 16), 10))
    # 6. loss function and optimizer
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(model.parameters(), lr=args.optim.lr)
    run.register(model=model, optimizer=optimizer)  # mixed precision: the run's GradScaler
    # 7. the training loop
    for epoch in run.epochs():
        model.train()
        for batch_idx, micro in enumerate(run.batches(train_dataset)):
            data, target = micro.data
            with run.autocast():
                output = model(data)
                loss = criterion(output, target)
            run.backward(loss, micro)
            if micro.closes_step:
                run.step(optimizer)
            # log from the main process only
            if run.is_main and batch_idx % 100 == 0:
                print(f'Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_dataset)}] Loss: {loss.item():.6f}')  # noqa: E501
        # 8. validation (every rank its share, each sample counted once)
        def sums(model, batch):
            data, target = batch
            output = model(data)
            return {'loss': ray_ddp.Sum(criterion(output, target) * len(target), len(target)),
                    'acc': ray_ddp.Sum((output.argmax(dim=1) == target).sum(), len(target))}
        val = run.evaluate(model, val_dataset, sums)
        val_loss, correct = val['loss'], round(val['acc'] * len(val_dataset))
        accuracy = 100. * correct / len(val_dataset)
        run.log(f'\nValidation set: Average loss: {val_loss:.4f}, Accuracy: {correct}/{len(val_dataset)} ({accuracy:.2f}%)\n')  # noqa: E501
        # 9. save the model (main process only)
        run.report({'val_loss': val_loss, 'val_acc': val['acc']})


if __name__ == '__main__':
    raise SystemExit(ray_ddp.main(main, best_metric='acc', best_mode='max'))
