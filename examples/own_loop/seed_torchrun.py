# ruff: noqa
# fmt: off
# The seed guide's complete torchrun script (its section 5), as the guide gives it, laid
# out one statement a line; its comments translated. Not run: YourDataset and YourModel
# are the reader's. seed_port.py is this script under ray_ddp (docs/own-loop.md's diff).
import os
import torch
import torch.nn as nn
import torch.distributed as dist
import torch.optim as optim
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.cuda.amp import autocast, GradScaler
import argparse


def main():
    # 1. parse the arguments
    parser = argparse.ArgumentParser()
    parser.add_argument('--local_rank', type=int, default=0, help='local rank for distributed training')
    parser.add_argument('--batch_size', type=int, default=32)
    parser.add_argument('--epochs', type=int, default=100)
    parser.add_argument('--lr', type=float, default=0.001)
    args = parser.parse_args()
    # 2. initialise the distributed environment
    dist.init_process_group(backend='nccl')
    torch.cuda.set_device(args.local_rank)
    device = torch.device('cuda', args.local_rank)
    # 3. fix the random seed (optional, for reproducibility)
    seed = 42
    torch.manual_seed(seed + args.local_rank)
    # 4. prepare the data
    # train_dataset = YourDataset(...)
    # val_dataset = YourDataset(...)
    train_sampler = DistributedSampler(train_dataset, shuffle=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True)
    # the validation set without DistributedSampler, or with it, minding how metrics are collected
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False, num_workers=4, pin_memory=True)
    # 5. build the model
    model = YourModel().to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    # 6. loss function and optimizer
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(model.parameters(), lr=args.lr)
    scaler = GradScaler()  # mixed precision training
    # 7. the training loop
    for epoch in range(args.epochs):
        # set the epoch, so that every epoch splits the data differently
        train_loader.sampler.set_epoch(epoch)
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            with autocast():
                output = model(data)
                loss = criterion(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            # log from the main process only
            if args.local_rank == 0 and batch_idx % 100 == 0:
                print(f'Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}] Loss: {loss.item():.6f}')
        # 8. validation (in the main process only)
        if args.local_rank == 0:
            model.eval()
            val_loss = 0
            correct = 0
            with torch.no_grad():
                for data, target in val_loader:
                    data, target = data.to(device), target.to(device)
                    output = model(data)
                    val_loss += criterion(output, target).item()
                    pred = output.argmax(dim=1, keepdim=True)
                    correct += pred.eq(target.view_as(pred)).sum().item()
            val_loss /= len(val_loader.dataset)
            accuracy = 100. * correct / len(val_loader.dataset)
            print(f'\nValidation set: Average loss: {val_loss:.4f}, Accuracy: {correct}/{len(val_loader.dataset)} ({accuracy:.2f}%)\n')
            # 9. save the model (main process only)
            torch.save({
                'epoch': epoch,
                'model_state_dict': model.module.state_dict(),
                'optimizer_state_dict': optimizer.state_dict(),
                'loss': val_loss,
            }, f'checkpoint_epoch_{epoch}.pth')
    # 10. tear down the process group
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
